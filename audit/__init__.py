"""Audit data, independent of the engine: stream hashes and run roots (`streams`, byte format in
FORMAT.md), run manifests (`manifest`), the crash-safe run folder (`store`, with `files` for atomic
writes), request-by-request comparison of runs (`compare`) and sealed, optionally signed
certificates (`certificate`); every bad input is an `errors.AuditError`."""
