"""`python -m stepstone`: the same command line as the `stepstone` script."""

from stepstone.cli import main

if __name__ == "__main__":
    main()
