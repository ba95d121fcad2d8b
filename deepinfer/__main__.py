import sys

from deepinfer.cli import main

sys.exit(main())
