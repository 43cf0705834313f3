"""Registration: writing new versions and modes to the schema registry, judged for
compatibility on how each field becomes a column (above the rows stage), and the
``ba-schema`` command line."""
