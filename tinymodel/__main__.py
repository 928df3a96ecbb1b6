"""`python -m tinymodel`: ensures the cached built-in model (trains it the first time) and prints
its directory, for processes that must not import torch themselves."""

import sys

from tinymodel.make import ensure_tiny_model

if __name__ == "__main__":
    print(ensure_tiny_model())
    sys.exit(0)
