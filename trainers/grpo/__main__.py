from trainers.config import run_main
from trainers.grpo.train import main

run_main(main)
