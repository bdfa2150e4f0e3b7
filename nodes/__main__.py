import sys

from nodes.main import main

sys.exit(main())
