import sys

from deploy.image_test.cli import main

sys.exit(main())
