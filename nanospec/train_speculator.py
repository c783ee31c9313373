"""``python -m nanospec.train_speculator``: another name for ``python -m nanospec.train`` (:mod:`nanospec.train`)."""

import sys

from nanospec.train.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
