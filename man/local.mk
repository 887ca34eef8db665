# man: pages are added by their owners below.
