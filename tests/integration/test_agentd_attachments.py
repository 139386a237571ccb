"""Attachments reach the model: images as the providers' image blocks, text files inline, and
a note for other files. Real storaged, toold and agentd; the offline model's request log."""
import base64
import json
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cflue_harness import common_pb2  # noqa: E402
from test_agentd import AgentdCase  # noqa: E402

PNG = base64.b64decode('iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk'
                       '+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==')
ATTACHMENTS = [
    {'name': 'dot.png', 'mime_type': 'image/png', 'data': PNG},
    {'name': 'notes.txt', 'mime_type': 'text/plain', 'data': 'remember the milk\n'.encode()},
    {'name': 'blob.bin', 'mime_type': 'application/octet-stream', 'data': b'\x00\x01\x02'},
]


class AttachmentsTest(AgentdCase):
    stack_kwargs = {'agents': ('runner-anthropic', 'runner-openai')}

    def send(self, agent):
        self.stack.fm.set_scenario([{'text': 'seen'}])
        adm = self.ad.submit(agent, 'look at these', attachments=ATTACHMENTS)
        sub = self.ad.get_submission(adm.submission_id, wait=True, timeout=60)
        self.assertEqual(sub.outcome, common_pb2.OUTCOME_COMPLETED, sub.error)
        self.check_records(adm)
        return self.stack.fm.requests()[-1]['body']

    def check_records(self, adm):
        """The user_message record names each attachment (the bytes stay with the
        submission, which keeps them verbatim)."""
        recs = self.ad.watch_all(adm.conversation_id)
        users = [r for r in recs if r.WhichOneof('body') == 'user_message']
        self.assertEqual(len(users), 1)
        refs = [(a.name, a.mime_type, a.size_bytes) for a in users[0].user_message.attachments]
        self.assertEqual(refs, [(a['name'], a['mime_type'], len(a['data'])) for a in ATTACHMENTS])
        sub = self.ad.get_submission(adm.submission_id)
        self.assertEqual([(a.name, a.mime_type, a.data) for a in sub.message.attachments],
                         [(a['name'], a['mime_type'], a['data']) for a in ATTACHMENTS])

    def test_anthropic_image_block_and_inline_text(self):
        body = self.send('runner-anthropic')
        content = body['messages'][0]['content']
        text = ' '.join(b.get('text', '') for b in content if b['type'] == 'text')
        images = [b for b in content if b['type'] == 'image']
        self.assertIn('look at these', text)
        self.assertIn('remember the milk', text)
        self.assertIn('blob.bin', text)
        self.assertIn('cannot be shown', text)
        self.assertEqual(len(images), 1)
        self.assertEqual(images[0]['source']['media_type'], 'image/png')
        self.assertEqual(base64.b64decode(images[0]['source']['data']), PNG)

    def test_openai_image_url_part(self):
        body = self.send('runner-openai')
        user = [m for m in body['messages'] if m['role'] == 'user'][0]
        parts = user['content']
        self.assertEqual(parts[0]['type'], 'text')
        self.assertIn('remember the milk', parts[0]['text'])
        urls = [p['image_url']['url'] for p in parts if p['type'] == 'image_url']
        self.assertEqual(len(urls), 1)
        prefix = 'data:image/png;base64,'
        self.assertTrue(urls[0].startswith(prefix))
        self.assertEqual(base64.b64decode(urls[0][len(prefix):]), PNG)


if __name__ == '__main__':
    unittest.main()
