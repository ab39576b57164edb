"""Teaching: the Lesson, its exercises and figures, one-click presets, the meeting bundle and the first screens'
explanations. Built on the views."""
