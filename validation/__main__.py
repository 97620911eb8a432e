"""``python -m validation``: the exactness suite (same options as ``canzona validate``)."""

from __future__ import annotations

import sys

from validation.cli import main

if __name__ == "__main__":
    sys.exit(main())
