"""Fixtures and reporting of the cluster tests."""

import pytest

from support.dynamo_workers import crds
from support.fault_report import FaultMatrixReport

__all__ = ["crds"]


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(FaultMatrixReport(config), "fault-matrix-report")
