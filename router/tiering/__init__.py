"""Picking the model size for a request of a tier alias: what a request looks like to the policy
(`features.py`), its settings (`settings.py`), the operator's rules and the tier hint (`policy.py`), and the optional learned
classifier with its training CLI (`classifier.py`, `python -m router.tiering`)."""
