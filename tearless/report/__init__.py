"""Run reports: plots of a run's metrics and a written diagnosis (``tearless report``/``compare``).

Import the submodules (``tearless.report.html``, ``tearless.report.diagnose``); matplotlib is loaded
only when a plot is drawn.
"""
