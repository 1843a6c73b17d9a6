import sys

from gatehouse.cli import main

sys.exit(main())
