"""`python -m ui [--simulated]`: the dashboard alone (the offline demo, or recorded logs only).

The dashboard of the real mesh is `prfaas serve ui`.
"""

import sys

from ui.serve import ui_main

sys.exit(ui_main())
