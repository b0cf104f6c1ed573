"""The prepared check for an accelerator machine (``scripts/device_check.sh`` runs these steps):
each step (``check``), the report that gathers them (``report``), and the server under load
(``serve_check``). docs/device-check.md says how to read the output."""
