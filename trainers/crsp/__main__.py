from trainers.crsp.train import main

main()
