import sys

from radbo.cli import main

sys.exit(main())
