from minillm.cli import main

raise SystemExit(main())
