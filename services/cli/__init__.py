"""The ``sluice`` command line: the operator API over HTTP (``SLUICE_API_URL``)."""
