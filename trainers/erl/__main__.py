from trainers.config import run_main
from trainers.erl.train import main

run_main(main)
