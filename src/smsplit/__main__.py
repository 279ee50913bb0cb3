import sys

from smsplit.cli import main

sys.exit(main())
