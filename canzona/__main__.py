import sys

from canzona.cli import main

sys.exit(main())
