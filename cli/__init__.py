"""The `reprise` command line (click): parse, call, print."""
