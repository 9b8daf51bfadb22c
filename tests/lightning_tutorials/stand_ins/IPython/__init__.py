"""A stand-in for IPython: the tutorials only ``display`` tables (``IPython.display``), which shows nothing here."""
