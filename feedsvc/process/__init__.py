"""Running processes: drain on SIGTERM (:mod:`.drain`), ``--workers``
(:mod:`.workers`), the ready file (:mod:`.readiness`) and the process's open
files, heap and collector (:mod:`.setup`). Only the command line and the test
harness use it; the signal that the process drains, which every floor checks,
stays at the package root (:mod:`feedsvc.drain_signal`)."""
