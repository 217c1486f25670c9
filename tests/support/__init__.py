"""What the tests share: how a test process runs JAX (``devices``), small pools and engine runs
on each page layout, the numpy references they are compared with, the state machines and the
hostile inputs. Each module says what it holds; none of them holds a test."""
