"""The inputs on which Gemma is compared with llama.cpp (see record_llama_cpp.py)."""

# Tokenization: unicode, digits, whitespace runs, code, markup, specials.
CORPUS = (
    'Hello world',
    'The year 2026 had 365 days; 3.14159 is not 22/7.',
    '1234567890 0000 007 12,345,678.90 1e-9 0x1F',
    '  two  spaces, then   three, then a tab\tand\t\ttwo tabs',
    'line one\nline two\n\nafter a blank line\n\n\n\nfour newlines',
    'trailing spaces   \n   leading spaces',
    'def f(x: int) -> int:\n    """Squares x."""\n    return x ** 2  # done\n',
    'for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }',
    '<div class="note">a &amp; b</div> <start_of_turn>user',
    'héllo wörld, naïve café, Ærøskøbing, Straße',
    'Съешь же ещё этих мягких французских булок',
    '日本語のテキストと中文文本，还有한국어 텍스트。',
    'emoji: 🙂🚀👍🏽 and 🇫🇷 flags, math: ∑ᵢ xᵢ² ≤ ∞, arrows → ⇒',
    'Ünïcödé  mixed\u00a0nbsp\u2009thin\u200bzero-width',
    'ﬁ ligature, Ｆｕｌｌｗｉｄｔｈ, ① circled, ½ fraction',
    'CamelCaseIdentifier snake_case_name kebab-case-name SCREAMING_CASE',
    'https://example.com/path?q=1&r=two#frag user@example.org',
    '\x00\x01 control bytes and a \x7f delete',
    '',
    ' ',
    '\n',
    'a',
    'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa',
    '!!!???...;;;:::---___===+++***',
    'Mr. O\'Neil\'s "quoted" text — with an em dash – and an en dash.',
)

# Greedy generation: 20 prompts, each continued by GREEDY_STEPS tokens.
PROMPTS = (
    'The capital of France is',
    'Water boils at a temperature of',
    'Once upon a time, there was a',
    'def fibonacci(n):\n',
    'The three primary colors are',
    'In 1969, the first humans',
    'import numpy as np\n\nx =',
    'The best way to learn a new language is',
    'Q: What is 7 times 8?\nA:',
    'My favourite food is',
    'The quick brown fox',
    'Photosynthesis is the process by which',
    'SELECT name FROM users WHERE',
    'Dear Sir or Madam,\n\nI am writing to',
    'The largest planet in the solar system is',
    'A haiku about autumn:\n',
    'Paris, London, Berlin, Madrid,',
    'The theory of relativity was developed by',
    '1, 2, 3, 4, 5,',
    'To make a cup of tea, first',
)
GREEDY_STEPS = 24

# Next-token logits at every position of this text (about 700 tokens with
# BOS: past the 512-token sliding window of the local layers).
PASSAGE = """\
The river rose slowly through the night, and by morning the lower fields \
had become a single sheet of grey water. The farmers who lived along the \
valley had seen floods before, but none had come so early in the year, and \
few of them had moved their animals to the higher ground. By nine o'clock \
the schoolhouse bell was ringing, not to call the children to their \
lessons, but to warn the families on the far bank that the old wooden \
bridge would not hold much longer.

Margaret Hale had lived in the valley for forty-one years. She remembered \
the flood of 1953, when the water reached the second step of the church, \
and the dry summer of 1976, when the river shrank to a line of stones and \
the boys walked across it without wetting their knees. She kept a notebook \
in which she wrote the level of the river every day, in pencil, with the \
date and the weather. Her late husband had laughed at the habit, but the \
county engineers had twice asked to copy the pages, and she had let them.

That morning she wrote: "March 3. Rain all night, wind from the south-west. \
Water at the gate post, 14 inches above the mark." Then she put on her \
boots, took the lantern from its hook, and went out to open the barn.

The engineers would later say that the flood was the result of three \
causes acting together: an unusually wet winter, a sudden thaw in the \
hills, and a storm that stalled over the watershed for almost two days. \
Each alone would have been manageable. Together they sent more water down \
the valley than the channel had carried in a century. The report, which \
ran to two hundred pages, recommended a new embankment, a wider culvert \
under the railway, and a gauge at the bridge that would send its readings \
to the county office every fifteen minutes.

None of that mattered on the morning itself. What mattered was that the \
Dawsons' cattle were standing in water up to their bellies, that the \
post van could not get through, and that old Mr. Petrie, who was ninety \
and almost deaf, had not answered his door. Margaret found him sitting in \
his kitchen with a cup of cold tea, reading the newspaper from the day \
before, entirely unaware that his garden had become part of the river.

"You'll have to come with me," she told him, loudly and slowly.

"Is it Tuesday?" he asked.

"It's Thursday, and the bridge is going."

He folded the newspaper with great care, finished his tea, and put on his \
coat. On the way up the hill he told her, for perhaps the twentieth time, \
about the winter of 1947, when the snow had drifted so high that the \
postman delivered letters through the upstairs windows. She had heard the \
story many times, but she listened anyway, because it kept him walking, \
and because it was, after all, a good story.

By noon the bridge was gone. By evening the rain had stopped, and the \
water began, very slowly, to fall. Margaret wrote in her notebook: \
"Water at the third fence rail. Bridge lost at 11.40. All safe."
"""
