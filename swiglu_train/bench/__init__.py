"""What the ``bench*`` and ``pretune`` commands run, one sub-package each, on a shared clock."""
