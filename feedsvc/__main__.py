from feedsvc.cli import main

raise SystemExit(main())
