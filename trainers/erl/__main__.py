from trainers.erl.train import main

main()
