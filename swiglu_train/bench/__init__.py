"""What the bench commands, pretune and the lab's harnesses run: a sub-package each."""
