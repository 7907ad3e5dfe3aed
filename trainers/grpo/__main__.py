from trainers.config import run_main

run_main("trainers.grpo.train")
