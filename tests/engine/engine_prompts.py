"""The engine tests' short code prompts (a module of its own: test modules import it by a name
no other test directory uses, where `from conftest import` found tests/e2e/conftest.py when
an e2e module was collected first in the same process)."""

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push",
    "# Copyright",
    "for i in range(10):\n    print(",
    "    return self._",
    'if __name__ == "__main__":\n    ',
    "from collections import",
]
