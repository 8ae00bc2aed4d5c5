"""``python -m zeroshard.cli``: the same as the ``zeroshard`` console script."""

from zeroshard.cli.main import main

raise SystemExit(main())
