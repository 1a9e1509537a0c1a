"""`python -m ui [--demo]`: the dashboard alone (what `prfaas serve ui` runs)."""

import sys

from ui.serve import ui_main

sys.exit(ui_main())
