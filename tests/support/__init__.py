"""What the tests share: paths, small models and graphs, the forked-process server, the programs tests run in
processes of their own (``*_run.py``)."""
