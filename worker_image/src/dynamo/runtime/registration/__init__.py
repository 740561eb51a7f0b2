"""Registration: what this worker publishes in discovery, and when it is listed.

* `advertise`: builds the `WorkerAdvertisement` from the worker's and the engine's configs
  (pure);
* `registrar`: `Registration`, the worker's entry in its discovery backend (register,
  republish on adapter and taint changes, leave once on shutdown).
"""
