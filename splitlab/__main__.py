"""`python -m splitlab` is the same entry point as the `splitlab` console script."""

from splitlab.cli import console_main

if __name__ == "__main__":
    console_main()
