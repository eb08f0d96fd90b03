"""``swarmpipe.peer``: the library every participant runs, one folder per role.

transport/ (bytes on the wire) <- swarm/ (the DHT) <- model/, optim/ <- stage/ (a volunteer's daemon)
and trainer/ (drives micro-batches). ``spec`` (the run spec), ``config`` (the config tree) and
``events`` (logs and the event log) are shared by all of them.
"""
