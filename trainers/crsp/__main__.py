from trainers.config import run_main

run_main("trainers.crsp.train")
