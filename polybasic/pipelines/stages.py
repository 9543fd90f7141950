"""Imports every stage module so that each registers its command in pipelines.cli.STAGES."""
from polybasic.pipelines import quantize  # noqa: F401
from polybasic.pipelines import distill  # noqa: F401
