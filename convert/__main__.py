import sys

from ..cli.convert import main

sys.exit(main())
