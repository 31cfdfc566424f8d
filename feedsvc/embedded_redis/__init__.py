"""The Redis that ``feedsvc serve`` runs itself when given no ``--redis-url``:
a private ``redis-server`` on a free port (:mod:`.server`, also what tests,
bench and loadtest start), its data dir and the record of which server wrote
it (:mod:`.data_dir`), and the watchdog that keeps it alive and reports it in
``/v2/health`` (:mod:`.supervisor`)."""
