"""expframe entry point: flags -> gin -> run_experiment (the program is `expframe.cli`).

    python main.py --gin_file=experiments/quickstart.gin [--gin_param='Trainer.train_steps=100'] [--model_dir=DIR]

The same program is `python -m expframe` and, once installed, the `expframe` command.
Exit status: 0 success, 2 configuration error (one line on stderr), 1 failure during the run.
"""

from expframe.cli import main

if __name__ == "__main__":
    main()
