import gc
import sys

gc.disable()        # during the CLI's imports too: cli.run explains, and turns it back on
from .cli import run  # noqa: E402

sys.exit(run())
