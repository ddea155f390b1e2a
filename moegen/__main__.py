from moegen.cli import main

raise SystemExit(main())
