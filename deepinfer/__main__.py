"""`python -m deepinfer` is the `deepinfer` console script: the engine's commands and the harness's."""

import sys

from deepinfer.harness.cli import main

sys.exit(main())
