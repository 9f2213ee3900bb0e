"""`tokenfab doctor`: read what a running server measures and name what limits it.

scrape.py turns two `/metrics` scrapes into a measured window; rules.py (pure) turns the window,
an optional bench result and the hardware's roofline into findings; cli.py is the command.
The server's `/doctor` endpoint runs the same rules on its own metrics.
"""
