from trainers.config import run_main
from trainers.guidance.train import main

run_main(main)
