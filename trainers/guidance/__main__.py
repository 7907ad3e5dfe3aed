from trainers.guidance.train import main

main()
