"""`python -m ui`: the dashboard alone (recorded logs; controls of a running link and router).

The dashboard of the real mesh is `prfaas serve ui`, of the simulation `prfaas sim-dashboard`.
"""

import sys

from ui.serve import ui_main

sys.exit(ui_main())
