from kvbridge.cli import main

raise SystemExit(main())
