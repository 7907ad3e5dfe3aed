from trainers.config import run_main
from trainers.crsp.train import main

run_main(main)
