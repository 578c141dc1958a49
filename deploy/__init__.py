"""Deployment tooling: the image test (`image_test`) and the chart's values-schema generator.

Run from the repository root (`python -m deploy.image_test`, `python deploy/values_schema.py`);
not part of the installed package.
"""
